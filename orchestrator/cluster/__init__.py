"""Where stages run: one `Launch` (launch.py) in, one `Outcome` out.

`local` runs a stage in worker processes on this machine (or, for debugging, in this process).
SLURM is four small modules: `slurm_submit` turns a plan into jobs (resources, `afterok` chains, refusals in
config terms), `slurm_task` is what runs inside a job (rank from SLURM, checkpoint and requeue on its signal),
`slurm_queue` holds the records of submitted jobs and the squeue/sacct/scontrol/scancel calls, and `follow`
watches jobs until they end. Modules here may import the core (`dag`, `cache`, `tracking`, `report`,
`worker`) and `config`, never `run` or `sweep`, which import them.
"""
