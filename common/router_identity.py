"""How `bulkhead up` tells its own router from another server on the same port: it starts the
router with a random id in ``INSTANCE_ENV``, and the router puts that id in ``INSTANCE_HEADER`` of
its /health answers (router/app.py). An answer without it is not from the router `up` started."""

INSTANCE_ENV = "BULKHEAD_INSTANCE_ID"
INSTANCE_HEADER = "x-bulkhead-instance"
