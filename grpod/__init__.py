"""grpod: a GRPO training daemon that refuses to corrupt its own policy.

The namespace root. Its packages live in the repository's top-level directories and install
here (pyproject.toml maps them): `grpod.engine`, `grpod.guards`, `grpod.forensics`,
`grpod.daemon`. This package itself holds only the few low-level helpers every one of them
uses, and imports nothing heavy.
"""
