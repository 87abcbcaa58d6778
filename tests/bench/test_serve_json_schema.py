"""`ingot bench serve --json-schema FILE`: every request constrained by the schema, the
outputs that do not validate counted."""

from __future__ import annotations

import json

import pytest

from ingot.bench.serve import schema_failures
from ingot.cli import main
from tests.helpers import write_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
          "required": ["n", "b"]}


def test_schema_failures_counts_what_does_not_validate():
    texts = ['{"n": 3, "b": true}', '{"n": 3, "b": tr', '{"n": 12, "b": false}', '{"b": true}', '{"n":0,"b":false}']
    count, first = schema_failures(texts, SCHEMA)
    assert count == 3 and first.startswith("JSONDecodeError")


def test_cli_json_schema(tmp_path, capsys):
    tiny = write_tiny_checkpoint(tmp_path / "llama", "llama")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--input-len", "8-16", "--output-len", "30-40", "--num-requests", "4", "--quiet", "--json", str(out),
            "--json-schema", str(schema)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert doc["environment"]["json_schema"] == str(schema)
    assert isinstance(r["schema_failures"], int) and 0 <= r["schema_failures"] <= 4
    # a request ends when its JSON does (ignore_eos is on): a complete output is a short one
    assert r["output_tokens"] < 4 * 30 or r["schema_failures"] == 4
    assert "schema failures" in capsys.readouterr().out


@pytest.mark.parametrize("text, problem", [("{nope", "not valid JSON"), ('{"type": "strin"}', "xgrammar cannot compile it")])
def test_cli_bad_schema_is_a_usage_error(tmp_path, capsys, text, problem):
    schema = tmp_path / "schema.json"
    schema.write_text(text)
    assert main(["bench", "serve", "--json-schema", str(schema), "--quiet"]) == 2
    assert problem in capsys.readouterr().err


def test_cli_json_schema_needs_a_local_engine(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["bench", "serve", "--json-schema", str(schema), "--url", "http://127.0.0.1:9"]) == 2
    assert "local engine only" in capsys.readouterr().err
