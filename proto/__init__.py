"""The wire contract between the router and the workers: bulkhead.proto and its generated stubs,
plus the one convention that lives outside the messages (ACCEPTED)."""

# Initial metadata a worker sends as the first thing its Prefill or Generate handler does: the
# router then knows the worker took the call, so a connection lost after it is the worker dying
# under the call (router/crash_blame.py), and one lost before it is a worker never reached.
ACCEPTED = ("bulkhead-accepted", "1")
