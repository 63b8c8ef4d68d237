"""Where a run's MLflow calls go: the store's URI (a sqlite file in the project's state folder by default, made from
the template: `sqlite_template`), experiments and their artifact folder, the client a worker logs with, and what
never reaches the store or the logs (secrets)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from pipelines.config import STATE_DIR
from pipelines.tracking.sqlite_template import prepare_sqlite_store


# Whole words of the key (between ".", "_", "-"): hf_token and db.password are hidden, mixture_tokens is a knob.
_SECRET_KEY = re.compile(r"(?:^|[._-])(token|secret|password|passwd|api[_-]?key|credentials?)(?:$|[._-])", re.I)


# The userinfo of a URI: user:password@, or a token alone as the user (https://TOKEN@github.com), which only a scheme
# tells from an address (alice@example.com). All of it goes: a user name is half a credential.
_URI_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*:)?//(?P<info>[^/?#@\s]+)@", re.I)
# Query parameters whose value grants access, matched on the whole name or its last word (between "_", "-", "."):
# OAuth's access_token/refresh_token/id_token and any *_token (Jupyter's token=, a page_token is hidden too: harmless),
# password/passwd/pwd (database URIs take ?password=), secret (client_secret), api_key/apikey and Google's key=,
# signed URLs' signatures (Azure SAS sig=, S3 presigned Signature and X-Amz-Signature, X-Goog-Signature), S3's
# X-Amz-Credential and AWSAccessKeyId (the key id that signed) and X-Amz-Security-Token (an STS session token).
# Not `key` as a last word: MLflow's own metric_key= names a metric.
_SECRET_QUERY_NAME = re.compile(
    r"(?:.*[._-])?(?:token|password|passwd|pwd|secret|sig|signature|credential|api[_-]?key|apikey)|key|awsaccesskeyid",
    re.I)
_QUERY_VALUE = re.compile(r"(?P<name>(?<=[?&;])[\w.-]+)=(?P<value>[^&#;\s'\"<>)]+)")


def tracking_uri(configured: str | None = None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else a sqlite store in the project folder. A sqlite store that does
    not exist yet is created here, from a copy of an empty one (pipelines.tracking.sqlite_template)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{STATE_DIR / 'mlflow.db'}"
    prepare_sqlite_store(uri, sqlite_artifact_root(uri))
    no_links_with_credentials(uri)
    return uri


def no_links_with_credentials(uri: str) -> None:
    """MLflow prints a link to a run it ends ("View run ... at: URL") built from the store's URI as given, credentials
    and all: turned off in this process (and those it starts) for a URI that carries any."""
    if hide_credentials(uri) != uri:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def hide_credentials(text: str) -> str:
    """`text` with the credentials of any URI in it replaced by ***: its userinfo (user:password, a token), and the
    values of its query parameters that grant access (`_SECRET_QUERY_NAME`)."""

    def userinfo(found: re.Match) -> str:
        if found["scheme"] is None and ":" not in found["info"]:  # //name@ with no scheme: not surely a URI
            return found[0]
        return f"{found['scheme'] or ''}//***@"

    def query(found: re.Match) -> str:
        return f"{found['name']}=***" if _SECRET_QUERY_NAME.fullmatch(found["name"]) else found[0]

    return _QUERY_VALUE.sub(query, _URI_USERINFO.sub(userinfo, text))


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Hide values of secret-looking keys and credentials embedded in URIs."""
    out = {}
    for key, value in params.items():
        if _SECRET_KEY.search(key):
            out[key] = "***"
        elif isinstance(value, str):
            out[key] = hide_credentials(value)
        else:
            out[key] = value
    return out


def redact_tree(value: Any) -> Any:
    """`redact` through nested mappings and lists (a whole config): secret-looking keys' values hidden at any depth,
    credentials hidden in every string."""
    if isinstance(value, dict):
        return {k: "***" if isinstance(k, str) and _SECRET_KEY.search(k) else redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v) for v in value]
    return hide_credentials(value) if isinstance(value, str) else value


def redact_yaml(text: str) -> str:
    """A YAML config (the run's config.yaml) with `redact_tree` applied; text that is no mapping, credentials hidden."""
    import yaml

    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return hide_credentials(text)
    if not isinstance(loaded, dict):
        return hide_credentials(text)
    return yaml.safe_dump(redact_tree(loaded), sort_keys=False)


def sqlite_artifact_root(uri: str) -> str | None:
    """`mlartifacts/` beside a sqlite store's file, as an absolute URI (None for other stores).

    MLflow's default for a database store is `./mlruns` of whichever process creates the experiment:
    Ray workers (other working directories) would scatter a run's artifacts, and a run from a
    checkout would write into it."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri[len(prefix):] in ("", ":memory:"):
        return None
    return (Path(uri[len(prefix):]).resolve().parent / "mlartifacts").as_uri()


def experiment_id(client, uri: str, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = sqlite_artifact_root(uri)
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another process
        return client.get_experiment_by_name(name).experiment_id


def is_local_store(uri: str) -> bool:
    """A store on this node's disk (sqlite file, plain path), as opposed to a server or database every node reaches."""
    return uri.startswith(("sqlite:///", "file:")) or "://" not in uri


def worker_client(uri: str, run_id: str):
    """The client a Ray worker logs run `run_id` with: through the run's relay when `tracked_run` started one (a
    store on the driver's disk, a job that may span nodes), else straight to the store."""
    if is_local_store(uri):
        # deferred: Ray loads where runs are logged, not where a job only parses its config
        import ray

        from pipelines.tracking.relay import RelayClient

        if ray.is_initialized():
            try:
                return RelayClient(run_id)
            except ValueError:  # no relay: a run logged outside tracked_run, on its own node
                pass
    no_links_with_credentials(uri)
    return MlflowClient(uri)
