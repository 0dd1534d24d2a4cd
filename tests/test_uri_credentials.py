"""No credential from a URI is ever printed, logged or saved: URIs carrying one are refused without
being echoed, and every message naming a URI can be redacted."""
import pytest

from pipeline.cli import EXIT_INVALID_INPUT, main
from pipeline.config.loading import load_config
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.uris import credentials_in, is_uri, redact

SECRET = "s3cret"


@pytest.mark.parametrize("uri,shown", [
    ("http://user:s3cret@host:5000/path", "http://***@host:5000/path"),
    ("http://s3cret@host", "http://***@host"),
    ("s3://bucket/train.beton?X-Amz-Credential=AKIA&X-Amz-Signature=s3cret&partNumber=2",
     "s3://bucket/train.beton?X-Amz-Credential=***&X-Amz-Signature=***&partNumber=2"),
    ("https://host/data?token=s3cret#part", "https://host/data?token=***#part"),
    ("https://acct.blob.core.windows.net/c/f.beton?sv=2020&sig=s3cret", "https://acct.blob.core.windows.net/c/f.beton?sv=2020&sig=***"),
    ("http://us:er:s3cret@[::1/x", "http://***@[::1/x"),
], ids=["password", "token_as_user", "presigned_s3", "token_query", "azure_sas", "unparseable"])
def test_redact_masks_userinfo_and_secret_query_values_and_keeps_the_rest(uri, shown):
    assert redact(uri) == shown


def test_redact_masks_every_uri_inside_a_message_and_leaves_other_text():
    message = "cannot reach 'https://alice:s3cret@a.example/x.json': ClientError: 403 for https://b.example/?token=s3cret"
    redacted = redact(message)
    assert SECRET not in redacted
    assert redacted == "cannot reach 'https://***@a.example/x.json': ClientError: 403 for https://b.example/?token=***"


def test_a_uri_without_credentials_is_unchanged_by_redact():
    assert redact("gs://bucket/data/train.beton") == "gs://bucket/data/train.beton"


@pytest.mark.parametrize("uri", ["postgresql://mlflow@db/store", "hdfs://etl@namenode:8020/data/train.beton"])
def test_an_account_name_of_a_database_or_hdfs_uri_is_not_a_credential(uri):
    assert credentials_in(uri) is None


def test_credentials_in_names_the_kind_of_secret_never_the_secret():
    kinds = [credentials_in(uri) for uri in
             ("http://u:s3cret@h", "http://s3cret@h", "https://h/f?access_token=s3cret", "http://u:s3cret@[::1")]
    assert all(kind for kind in kinds) and not any(SECRET in kind for kind in kinds)


def test_is_uri_tells_a_scheme_from_a_local_path():
    assert is_uri("file:///data/train.beton") and not is_uri("/data/train.beton")


@pytest.mark.parametrize("key", ["data.train", "data.val", "run.storage_path", "tune.storage_path", "data.cache_dir"])
def test_a_location_uri_with_a_password_exits_2_without_echoing_it(capsys, key):
    code = main(["config", "validate", "--config", "smoke", "--set", f"{key}=http://user:{SECRET}@host/train.beton"])
    assert code == EXIT_INVALID_INPUT
    message = capsys.readouterr().err
    assert key in message and "password" in message and SECRET not in message


def test_a_presigned_dataset_url_is_refused_without_echoing_its_signature():
    with pytest.raises(ConfigError) as err:
        load_config("smoke", [f"data.train=https://bucket.s3.amazonaws.com/t.beton?X-Amz-Signature={SECRET}"])
    assert "X-Amz-Signature" in str(err.value) and SECRET not in str(err.value)


def test_a_token_as_user_name_in_mlflow_tracking_uri_is_refused_without_echoing_it(monkeypatch):
    from pipeline.tracking.connection import resolve_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{SECRET}@mlflow.example.com")
    with pytest.raises(InvalidInputError) as err:
        resolve_tracking_uri(load_config("smoke"))
    assert "MLFLOW_TRACKING_URI" in str(err.value) and SECRET not in str(err.value)


def test_a_malformed_tracking_uri_is_refused_without_echoing_its_userinfo():
    with pytest.raises(ConfigError) as err:
        load_config("smoke", [f"tracking.mlflow_uri=http://user:{SECRET}@[::1"])
    assert "not a valid URI" in str(err.value) and SECRET not in str(err.value)


def test_staging_an_unreachable_uri_names_it_without_its_credentials():
    from pipeline.data.staging import StagingError, read_location_sidecar

    with pytest.raises(StagingError) as err:
        read_location_sidecar(f"http://user:{SECRET}@127.0.0.1:9/train.beton")
    assert "127.0.0.1:9/train.beton" in str(err.value) and SECRET not in str(err.value)
