"""lm-evaluation-harness against a real deployment: its ``local-completions`` model (the class
``lm_eval --model local-completions`` builds, sending completions with echo + logprobs) scores
hand-written loglikelihood requests through router + prefill + decode processes, and the
numbers equal transformers' on the same fp32 checkpoint and the same token ids (lm-eval's own
context/continuation split). Prompts long enough for the split route and short ones for the
decode route are both in the set. The multiple-choice task also runs through lm-eval's own
``hf`` backend on the same checkpoint: same loglikelihoods, same accuracy."""

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


MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "the sun", "42"],
     "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "mat", "text"],
     "answer": 0},
    {"question": "tell me a story about a cat that sat on a", "choices": ["cat", "mat", "dog"],
     "answer": 1},
    {"question": "The answer is", "choices": ["42.", "Paris.", "more text."], "answer": 0},
    {"question": "Hello world! What is the capital of France? Paris is the capital of France. "
                 "The quick brown fox jumps over the lazy dog, and then", "choices": [
                     "some more text.", "the sun.", "a story about a cat."], "answer": 0},
]
TASK_YAML = """task: bulkhead_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_multiple_choice_task_accuracy_equals_transformers(e2e: E2E, tmp_path,
                                                           monkeypatch) -> None:
    """A multiple-choice task written here (YAML + JSONL, no download) through
    ``lm_eval.simple_evaluate`` with ``local-completions``: every choice's loglikelihood, and so
    the accuracy, equals transformers' on the same token ids."""
    import json

    import transformers as tf
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    out = simple_evaluate(
        model="local-completions",
        model_args=f"base_url={e2e.deployment.url}/v1/completions,model={e2e.model},"
                   f"tokenizer={e2e.folder},tokenizer_backend=huggingface,batch_size=4,"
                   "max_retries=1,max_length=300",
        tasks=["bulkhead_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        log_samples=True)
    samples = out["samples"]["bulkhead_tiny_mc"]
    served = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    model = tf.AutoModelForCausalLM.from_pretrained(e2e.folder, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(e2e.folder)
    correct = 0
    for i, doc in enumerate(MC_DOCS):
        ref = []
        for choice in doc["choices"]:
            whole = tok(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            ctx = tok(doc["question"], add_special_tokens=False)["input_ids"]
            ref.append(reference(model, whole[:len(ctx)], whole[len(ctx):])[0])
        assert served[i] == pytest.approx(ref, abs=1e-3), doc["question"]
        correct += int(max(range(len(ref)), key=ref.__getitem__) == doc["answer"])
    acc = out["results"]["bulkhead_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(MC_DOCS))
    # lm-eval's own transformers backend on the same checkpoint and task
    hf = simple_evaluate(
        model="hf", model_args=f"pretrained={e2e.folder},dtype=float32,device=cpu",
        tasks=["bulkhead_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=4, log_samples=True)
    for s in hf["samples"]["bulkhead_tiny_mc"]:
        assert served[s["doc_id"]] == pytest.approx([float(r[0][0]) for r in s["resps"]],
                                                     abs=1e-3)
    assert hf["results"]["bulkhead_tiny_mc"]["acc,none"] == pytest.approx(acc)
