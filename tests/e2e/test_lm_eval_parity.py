"""lm-evaluation-harness against a real deployment: its ``local-completions`` model (the class
``lm_eval --model local-completions`` builds, sending completions with echo + logprobs) scores
hand-written loglikelihood requests through router + prefill + decode processes, and the
numbers equal transformers' on the same fp32 checkpoint and the same token ids (lm-eval's own
context/continuation split). Prompts long enough for the split route and short ones for the
decode route are both in the set. (lm-eval's ``hf`` backend would need ``accelerate`` as well;
the reference here is the forward that backend runs.)"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import E2E, SPLIT_THRESHOLD

lm_eval = pytest.importorskip("lm_eval")

PAIRS = [
    ("The answer is", " 42."),
    ("Hello world! What is the capital of France?", " Paris is the capital of France."),
    ("The quick brown fox jumps over the lazy dog, and then some more text. The quick brown fox",
     " jumps over the lazy dog."),
    ("user assistant system: tell me a story about a cat", " that sat on a mat in the sun."),
    ("Paris", " is"),
    ("Hello world! What is the capital of France? Paris is the capital of France. The answer is"
     " 42. The quick brown fox jumps over the lazy dog", ", and then some more text."),
]


def requests() -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(PAIRS)]


def reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's loglikelihood: sum of the continuation tokens' logprobs, and whether each is
    the argmax (is_greedy), from one forward of context + continuation."""
    ids = context + continuation
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(context) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(continuation)
    return (float(lp[torch.arange(len(continuation)), target].sum()),
            bool((lp.argmax(-1) == target).all()))


def test_local_completions_loglikelihoods_equal_transformers(e2e: E2E) -> None:
    import transformers as tf
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    served = LocalCompletionsAPI(base_url=e2e.deployment.url + "/v1/completions",
                                 model=e2e.model, tokenizer=str(e2e.folder),
                                 tokenizer_backend="huggingface", batch_size=3, max_retries=1,
                                 max_length=300)
    got = served.loglikelihood(requests())
    model = tf.AutoModelForCausalLM.from_pretrained(e2e.folder, dtype=torch.float32).eval()
    assert len(got) == len(PAIRS)
    lengths = []
    for (ll, _), (context, continuation) in zip(got, PAIRS, strict=True):
        ctx, cont = served._encode_pair(context, continuation)
        lengths.append(len(ctx) + len(cont))
        ref, _ = reference(model, ctx, cont)
        assert ll == pytest.approx(ref, abs=1e-3), (context, continuation)
        assert ll < 0
    # both routes ran: some prompts pass the router's split threshold and some do not
    assert min(lengths) < SPLIT_THRESHOLD < max(lengths)
