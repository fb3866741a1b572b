CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL, 
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);
CREATE TABLE runs (
	id VARCHAR(128) NOT NULL, 
	run_dir TEXT NOT NULL, 
	config_json TEXT NOT NULL, 
	config_digest VARCHAR(64) NOT NULL, 
	versions_json TEXT NOT NULL, 
	device VARCHAR(256) NOT NULL, 
	started_at DATETIME NOT NULL, 
	ended_at DATETIME, 
	PRIMARY KEY (id)
);
CREATE TABLE blobs (
	sha256 VARCHAR(64) NOT NULL, 
	size BIGINT NOT NULL, 
	kind VARCHAR(32) NOT NULL, 
	path TEXT NOT NULL, 
	created_at DATETIME NOT NULL, data BLOB, 
	PRIMARY KEY (sha256)
);
CREATE TABLE steps (
	id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	outcome VARCHAR(16) NOT NULL, 
	rerun BOOLEAN NOT NULL, 
	verdict_action VARCHAR(8) NOT NULL, 
	verdict_json TEXT NOT NULL, 
	batch_digest VARCHAR(64), 
	report_json TEXT NOT NULL, 
	recorded_at DATETIME NOT NULL, 
	valid_tokens INTEGER NOT NULL, 
	expected_valid_tokens INTEGER NOT NULL, 
	loss FLOAT, 
	grad_norm FLOAT, 
	clip_coef FLOAT, 
	lr FLOAT, 
	reward_mean FLOAT, 
	reward_std FLOAT, 
	zero_std_group_fraction FLOAT, 
	advantage_abs_max FLOAT, 
	kl FLOAT, 
	clip_fraction_low FLOAT, 
	clip_fraction_high FLOAT, 
	mismatch_mean FLOAT, 
	mismatch_p90 FLOAT, 
	mismatch_p99 FLOAT, 
	mismatch_max FLOAT, 
	mismatch_frac_above_0_1 FLOAT, 
	completion_length_mean FLOAT, 
	completion_length_max INTEGER NOT NULL, 
	num_micros INTEGER NOT NULL, 
	num_samples INTEGER NOT NULL, entropy FLOAT, context_json TEXT, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_steps_run_step ON steps (run_id, step);
CREATE TABLE checkpoints (
	id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	path TEXT NOT NULL, 
	pinned BOOLEAN NOT NULL, 
	deleted BOOLEAN NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_checkpoints_run_step ON checkpoints (run_id, step);
CREATE TABLE incidents (
	id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	step_id INTEGER NOT NULL, 
	action VARCHAR(8) NOT NULL, 
	verdict_json TEXT NOT NULL, 
	findings_json TEXT NOT NULL, 
	checkpoint_id INTEGER, 
	created_at DATETIME NOT NULL, guard VARCHAR(64), kind VARCHAR(64), last_step INTEGER, steps_count INTEGER DEFAULT '1' NOT NULL, worst_step INTEGER, worst_step_id INTEGER, worst_checkpoint_id INTEGER, status VARCHAR(8) DEFAULT 'closed' NOT NULL, closed_at DATETIME, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, 
	FOREIGN KEY(step_id) REFERENCES steps (id), 
	FOREIGN KEY(checkpoint_id) REFERENCES checkpoints (id)
);
CREATE TABLE evals (
	id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	samples INTEGER NOT NULL, 
	temperature FLOAT NOT NULL, 
	rewards_json TEXT NOT NULL, 
	completion_length_mean FLOAT NOT NULL, 
	seconds FLOAT NOT NULL, 
	recorded_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_evals_run_step ON evals (run_id, step);
CREATE TABLE step_ranks (
	id INTEGER NOT NULL, 
	step_id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	batch_digest VARCHAR(64), 
	first_micro INTEGER NOT NULL, 
	num_micros INTEGER NOT NULL, 
	first_sample INTEGER NOT NULL, 
	num_samples INTEGER NOT NULL, 
	valid_tokens INTEGER NOT NULL, 
	expected_valid_tokens INTEGER NOT NULL, 
	local_loss FLOAT, 
	report_json TEXT NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(step_id) REFERENCES steps (id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX ux_step_ranks_step_rank ON step_ranks (step_id, rank);
CREATE INDEX ix_step_ranks_run_step_rank ON step_ranks (run_id, step, rank);
CREATE TABLE prompt_ledger (
	id INTEGER NOT NULL, 
	run_id VARCHAR(128) NOT NULL, 
	step INTEGER NOT NULL, 
	fate VARCHAR(16) NOT NULL, 
	prompt_id BIGINT NOT NULL, 
	epoch INTEGER, 
	epoch_size INTEGER, 
	task_row INTEGER, 
	generation_pass INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	stale_drops INTEGER NOT NULL, 
	reason TEXT NOT NULL, 
	superseded BOOLEAN DEFAULT 0 NOT NULL, 
	recorded_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);
CREATE INDEX ix_prompt_ledger_run_prompt ON prompt_ledger (run_id, prompt_id);
CREATE INDEX ix_prompt_ledger_run_step ON prompt_ledger (run_id, step);
CREATE TABLE incident_attributions (
	id INTEGER NOT NULL, 
	incident_id INTEGER NOT NULL, 
	step INTEGER NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	note TEXT NOT NULL, 
	seconds FLOAT, 
	attribution_json TEXT, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(incident_id) REFERENCES incidents (id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX ux_incident_attributions_incident ON incident_attributions (incident_id);
