from router.quarantine import Quarantine, prompt_fingerprint


def test_entries_expire_and_fingerprints_are_stable():
    now = [100.0]
    q = Quarantine(ttl_s=10.0, clock=lambda: now[0])
    fp = prompt_fingerprint([1, 2, 3])
    assert fp == prompt_fingerprint((1, 2, 3)) != prompt_fingerprint([1, 2, 4])
    assert not q.contains(fp)
    q.add(fp)
    assert q.contains(fp)
    now[0] += 10.0
    assert not q.contains(fp)
