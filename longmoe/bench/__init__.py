"""Benchmarks behind `longmoe bench`; results are committed as JSON with device, versions and date."""
