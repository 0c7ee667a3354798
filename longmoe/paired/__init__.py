"""Candidate-vs-reference harness shared by `longmoe paired` and the test suite."""
