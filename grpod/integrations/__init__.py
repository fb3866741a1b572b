"""Other trainers under grpod's guards, recorder, metrics and replay (DESIGN.md "Other trainers
under grpod's guards"). `grpod.integrations.trl`: TRL's GRPOTrainer (extra `trl`)."""
