"""/tokenize, /detokenize, /version and /v1/models/{id} on the real router app (fake workers),
with the official client where it has a call for it."""

from __future__ import annotations

import openai
import pytest

from router.tokenize_api import token_strings
from tests.router.conftest import MODEL, Cluster

pytestmark = pytest.mark.timeout(120)

CHAT = [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hello world"}]


def test_tokenize_prompt_and_chat(cluster: Cluster) -> None:
    with cluster.http() as h:
        r = h.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert r["tokens"] == cluster.tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 512
        r = h.post("/tokenize", json={"messages": CHAT}).json()
        # a chat is counted as a chat completion would render it (developer as system)
        sys_chat = [{"role": "system", "content": "Be brief"}, CHAT[1]]
        assert r["tokens"] == cluster.tok.encode(cluster.tok.apply_chat_template(sys_chat),
                                                 add_special_tokens=False)
        bad = h.post("/tokenize", json={"prompt": "x", "messages": CHAT})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert h.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
        # vLLM's return_token_strs: each token's vocabulary entry
        r = h.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["token_strs"] == token_strings(cluster.tok, r["tokens"])
        assert "".join(r["token_strs"]).endswith("Hello world")  # this fake: a char a token
        assert h.post("/tokenize", json={"prompt": "x"}).json()["token_strs"] is None
        bad = h.post("/tokenize", json={"prompt": "x", "add_special_tokens": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"


def test_token_strings_are_the_vocabulary_entries_of_a_real_tokenizer() -> None:
    from common.tokenizer import Tokenizer
    from tests.helpers.default_model import default_model_or_skip

    tok = Tokenizer.from_path(str(default_model_or_skip()))
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert token_strings(tok, ids) == ["Hello", "\u0120world"]  # byte-level BPE's space mark


def test_detokenize_round_trips(cluster: Cluster) -> None:
    ids = cluster.tok.encode("The answer is 42.")
    with cluster.http() as h:
        assert h.post("/detokenize", json={"tokens": ids}).json() == {
            "prompt": "The answer is 42."}
        bad = h.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_model_card_and_version(cluster: Cluster) -> None:
    client = cluster.client()
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "bulkhead"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with cluster.http() as h:
        assert h.get("/version").json()["version"]


def test_the_sliced_json_body_is_the_bytes_jsonresponse_writes() -> None:
    from fastapi.responses import JSONResponse

    from router.tokenize_api import JSON_SLICE, json_body

    long_ids = list(range(JSON_SLICE * 2 + 7))
    long_text = ("ça va? \"quoted\" \\ \n 🙂 " * (JSON_SLICE * 3))[: JSON_SLICE * 40 + 3]
    for answer in ({"count": 2, "max_model_len": None, "tokens": [1, 2], "token_strs": None},
                   {"count": len(long_ids), "tokens": long_ids, "token_strs": ["Ġa"] * 3},
                   {"prompt": long_text}, {"prompt": ""}, {"tokens": []}):
        assert json_body(answer) == JSONResponse(answer).body
