"""vitsweep's model zoo: the five papers' models registered in timm's registry.

Importing this package registers every variant; build any of them with
``timm.create_model(name, **overrides)``.
"""
from models._registry import VARIANTS, PaperFacts, register_variant

__all__ = ["VARIANTS", "PaperFacts", "register_variant"]
from models import eit  # noqa: F401
from models import sot  # noqa: F401
from models import vit, xcit  # noqa: F401
