from router.quarantine import Quarantine, request_fingerprint
from router.worker_codec import Sampling


def test_entries_expire_and_fingerprints_are_stable():
    now = [100.0]
    q = Quarantine(ttl_s=10.0, clock=lambda: now[0])
    fp = request_fingerprint("m", [1, 2, 3])
    assert fp == request_fingerprint("m", (1, 2, 3)) != request_fingerprint("m", [1, 2, 4])
    assert not q.contains(fp)
    q.add(fp)
    assert q.contains(fp)
    now[0] += 10.0
    assert not q.contains(fp)


def test_the_fingerprint_is_of_the_model_prompt_and_sampling_but_not_the_seed():
    """The n choices of a request (seeds seed + i) are one request; the same prompt with another
    temperature or grammar, or for another model, is another."""
    prompt = [5, 6, 7]
    hot = Sampling(max_tokens=16, temperature=1e-45)
    fp = request_fingerprint("m", prompt, hot)
    assert fp == request_fingerprint("m", prompt, Sampling(max_tokens=16, temperature=1e-45,
                                                           seed=3))
    assert fp != request_fingerprint("m", prompt, Sampling(max_tokens=16, temperature=0.7))
    assert fp != request_fingerprint("m", prompt, Sampling(max_tokens=16, temperature=1e-45,
                                                           grammar_kind="json_object"))
    assert fp != request_fingerprint("other", prompt, hot)
    assert fp != request_fingerprint("m", prompt)
