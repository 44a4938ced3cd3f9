"""The ``tandem`` command line: the embedded stack, API keys, evaluations."""
