"""values.schema.json: the defaults pass; a misspelt value name or a wrong value fails
before anything is rendered (Helm checks the schema on install, upgrade and template)."""
from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.helm.conftest import CHART


def test_schema_is_valid_and_accepts_the_defaults():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


@pytest.mark.parametrize("values, named", [
    ({"replicaCount": 3}, "replicaCount"),                                   # top level: belongs to a role
    ({"worker": {"replicCount": 3}}, "replicCount"),
    ({"worker": {"engine": {"max_num_seqs": 64}}}, "max_num_seqs"),          # vLLM's spelling, not ours
    ({"gateway": {"autoscaling": {"targetCPU": 50}}}, "targetCPU"),
    ({"gateway": {"service": {"anotations": {}}}}, "anotations"),
    ({"model": {"pvc": {"claim": "models"}}}, "claim"),
    ({"inferencePool": {"endpointPicker": {"failuremode": "FailOpen"}}}, "failuremode"),
    ({"secrets": {"existingsecret": "x"}}, "existingsecret"),
])
def test_a_typo_in_a_value_name_is_rejected(chart, values, named):
    with pytest.raises(helm.HelmValuesError, match=named):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmError):
        chart.render(values, name="lpx", namespace="serving")


@pytest.mark.parametrize("values", [
    {"worker": {"device": "gpu"}},
    {"worker": {"engine": {"gpuMemoryUtilization": 1.5}}},
    {"worker": {"engine": {"gpuMemoryUtilization": "1.5"}}},                # as `--set` passes it
    {"worker": {"engine": {"maxNumSeqs": "many"}}},
    {"worker": {"engine": {"speculativeConfig": {"method": "eagle"}}}},
    {"worker": {"engine": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 0}}}},
    {"worker": {"engine": {"speculativeConfig": {"method": "ngram", "lookahead": 3}}}},
    {"adapterStore": {"type": "gcs"}},
    {"topology": "inference-pool"},
    {"pool": {"port": 0}},
    {"model": {"source": "huggingface"}},
    {"gateway": {"replicaCount": -1}},
    {"observability": {"logFormat": "yaml"}},
    {"observability": {"otlpEndpoint": "otel:4318"}},                         # no scheme: not a URL
    {"worker": {"adapterCacheSize": "lots"}},
    {"worker": {"adapterCacheSize": "16GiB"}},                                # not a Kubernetes quantity
    {"secrets": {"internalToken": "short"}},                                  # loraplex refuses < 16 characters
    {"secrets": {"adminToken": "also-too-short"}},
])
def test_a_wrong_value_is_rejected(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


@pytest.mark.parametrize("values, message", [
    ({"topology": "pool"}, "inferencePool.endpointPicker.name"),
    ({"inferencePool": {"enabled": True}}, "needs topology=pool"),  # the fleet's workers speak no OpenAI
    ({"adapterStore": {"type": "s3"}}, "adapterStore.s3.bucket"),
    ({"postgresql": {"enabled": False}}, "needs a database"),
    ({"worker": {"adapterCacheSize": None}}, "worker.adapterCacheSize is required"),  # unbounded: the pod is evicted
])
def test_incomplete_settings_fail_with_a_message_naming_the_value(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name="lpx", namespace="serving")
