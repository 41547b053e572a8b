"""The test suite: a folder a package of vlft (data, caches, forward, training, generation, jobs,
report), workflow/ for the whole workflow's promises; helpers.py what they share, conftest.py the
fixtures, slurm_runs.py the SLURM runs started in the background."""
