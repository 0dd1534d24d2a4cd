"""The python_function loader of MLflow models logged before serving moved to ``pipeline.trained.serving``.

An MLmodel file names its loader module (``loader_module: pipeline.serving``) and MLflow imports it by
that name to load or serve the model; models already logged and registered under this name keep loading.
"""
from pipeline.trained.serving import _load_pyfunc  # noqa: F401  (MLflow calls it by this module's name)
