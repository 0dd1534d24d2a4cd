"""Links into MLflow's UI open vitsweep's runs as model-training runs (not MLflow 3.17's GenAI pages)."""
import pytest

from pipeline.tracking.ui import ui_compare_link, ui_link


def test_a_run_link_opens_the_run_page_in_model_training_mode():
    assert (ui_link("http://mlflow:5000/", "3", run_id="abc")
            == "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning")


def test_a_run_link_with_an_artifact_opens_the_artifact_in_the_run_page():
    assert (ui_link("http://mlflow:5000", "3", run_id="abc", artifact="summary.html")
            == "http://mlflow:5000/#/experiments/3/runs/abc/artifacts/summary.html?workflowType=machine_learning")


def test_an_experiment_link_opens_its_runs_table_in_model_training_mode():
    assert ui_link("http://mlflow:5000", "3") == "http://mlflow:5000/#/experiments/3/runs?workflowType=machine_learning"


def test_an_experiment_link_with_a_view_opens_that_saved_view():
    assert (ui_link("https://m.example.com/mlflow", "3", view="vitsweep")
            == "https://m.example.com/mlflow/#/experiments/3/runs?viewStateShareKey=vitsweep&workflowType=machine_learning")


def test_a_compare_link_lists_the_runs_and_their_experiment():
    assert (ui_compare_link("http://mlflow:5000", "3", ["a", "b"])
            == 'http://mlflow:5000/#/compare-runs?runs=["a","b"]&experiments=["3"]&workflowType=machine_learning')


def test_a_link_into_a_store_that_is_not_a_server_is_refused_naming_the_uri():
    with pytest.raises(ValueError, match="sqlite:///runs/mlflow.db"):
        ui_link("sqlite:///runs/mlflow.db", "3")
