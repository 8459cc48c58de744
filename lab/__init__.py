"""The lab: benchmarks, probes and GPU scripts, and their results. It may import the product;
no product package imports it, and nothing here is installed with the package."""
