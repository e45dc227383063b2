# A one-node SLURM cluster on this host (slurmctld, slurmd, slurmdbd on MariaDB, munge) for the sweep as a job
# array (tests/test_slurm.py, docs/cluster.md). Installs with apt when missing and we are root; config, state,
# database and logs live in ~/.cache/quantdrift/slurm (QD_SLURM_HOME). A second `make slurm-up` is a no-op.
.PHONY: slurm-up slurm-down slurm-status print-slurm-conf

slurm-up:
	scripts/slurm-cluster up

slurm-down:
	scripts/slurm-cluster down

slurm-status:
	@scripts/slurm-cluster status

# `export SLURM_CONF=$(make -s print-slurm-conf)` points sinfo/sbatch/sacct (and submitit) at this cluster
print-slurm-conf:
	@scripts/slurm-cluster conf

# `make test-all` needs no target here: tests/test_slurm.py brings this cluster up where none answers (root, apt) and
# stops it again after its tests; where it cannot, the test is skipped with the reason
