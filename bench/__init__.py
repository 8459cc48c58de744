"""The `bulkhead bench` load generator (`load`) and its one-box split-vs-colocated run (`split`).
No runtime package imports this; the lab's benchmarks live in lab/bench."""
