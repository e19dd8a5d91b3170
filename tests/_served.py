"""`launch_local` as the tests of the HTTP APIs use it (module-scoped fixtures in several files), and their shared
tool schema. Their 1024-position tiny model is conftest's `tiny_model_dir_1k` (and `tokenizer_1k`)."""

from __future__ import annotations

from pathlib import Path

import together_train as tt


def launch_with_http(model_dir: str | Path, storage_dir: str | Path, api_key: str, *extra: str) -> tt.LocalResource:
    """A real resource: one generator replica, `api_key` required on both ports, the HTTP port on a free
    port (``client.http_url``), one trainer and one generator thread (CI has 2 cores); `extra` are more
    ``serve`` flags. Use as a context manager: ``with launch_with_http(...) as client``."""
    return tt.launch_local(model=str(model_dir), generators=1, storage_dir=storage_dir, api_key=api_key, http_port=0,
                           extra_args=["--trainer-threads", "1", "--generator-threads", "1", *extra])


# The forced-tool schema of the HTTP API tests (OpenAI Responses, Anthropic Messages): a random model's call
# under it is the grammar's doing, validated with jsonschema.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
