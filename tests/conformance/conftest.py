"""The tier conformance suite uses the shared S3 fixtures of tests/conftest.py."""
