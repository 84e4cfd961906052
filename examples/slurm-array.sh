#!/bin/bash
# Bulk remap as a Slurm job array: 4 tasks, each runs one shard of pairs.jsonl against
# the LMCache server of the node it runs on (`--shard auto` reads SLURM_ARRAY_TASK_ID,
# _MIN, _MAX and _COUNT; see docs/guides/deployment.md "Bulk jobs across hosts").
#
# Assumed (adapt): an LMCache server on every node of the partition at 127.0.0.1:5555
# (ZMQ) and :8080 (HTTP); pairs.jsonl and reports/ on a shared file system; lmcache-async
# installed in the environment the job activates.
#
# Resubmitting the same array after a failure resumes: each task skips the pairs its own
# report shows done. The array must be a range (0-3, 1-8, 0-15:4), not a list (1,3,7).
#SBATCH --job-name=lmcache-remap
#SBATCH --array=0-3
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --mem=4G
#SBATCH --time=02:00:00
#SBATCH --output=reports/slurm-%A_%a.out
set -euo pipefail

mkdir -p reports
srun lmcache-async remap-batch pairs.jsonl --model-name my-model --url tcp://127.0.0.1:5555 --http-url http://127.0.0.1:8080 --shard auto --report "reports/report-${SLURM_ARRAY_TASK_ID}.jsonl" --resume --json
