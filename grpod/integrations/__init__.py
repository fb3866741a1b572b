"""Other trainers under grpod's guards, recorder, metrics and replay (docs/ARCHITECTURE.md
"Other trainers under grpod's guards"). `grpod.integrations.trl`: TRL's GRPOTrainer (extra
`trl`)."""
