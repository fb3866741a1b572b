"""grpod: a GRPO training daemon that refuses to corrupt its own policy.

The namespace root. Its packages live in the repository's top-level directories and install
here (pyproject.toml maps them): `grpod.engine`, `grpod.guards`, `grpod.forensics`,
`grpod.daemon`. In this directory: `grpod.base` (the ground layer every package uses) and
`grpod.integrations` (front ends for other trainers, the top layer). docs/ARCHITECTURE.md
draws the layers.
"""
