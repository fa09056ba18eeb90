#!/bin/bash
# Submits one night's sharded job to AWS Batch: an array job of N shards, then a finalize job that depends on it.
#   aws batch register-job-definition --cli-input-json file://jobs/cluster/aws-batch-job-definition.json  # once
#   jobs/cluster/aws-batch-submit.sh gpu-spot-queue s3://my-bucket/tickets/2026-11-30/ s3://my-bucket/summaries/2026-11-30/ 8
# Each child gets AWS_BATCH_JOB_ARRAY_INDEX; the shard count goes in NIGHTSHIFT_SHARDS, since AWS Batch does
# not put the array size in the environment. The job definition's retry strategy retries Spot reclaims
# ("Host EC2*") and exit 75 (drained after SIGTERM: the retry resumes from the committed units) and gives up on
# anything else, such as a bad job file, input or model (exit 2-5). The finalize job runs once every shard has
# succeeded; if a shard fails for good, `nightshift status OUTPUT` names it: resubmit and finalize again.
set -euo pipefail
queue=${1:?usage: aws-batch-submit.sh QUEUE INPUT_URL OUTPUT_URL SHARDS}
input=${2:?input URL}
output=${3:?output URL}
shards=${4:?shard count}
definition=${JOB_DEFINITION:-nightshift}
name=nightshift-$(date -u +%Y%m%d-%H%M%S)

overrides=$(printf '{"command":["run","/etc/nightshift/nightly.toml","--input","%s","--output","%s","--shard","auto","--no-progress"],"environment":[{"name":"NIGHTSHIFT_SHARDS","value":"%s"}]}' "$input" "$output" "$shards")
array_job=$(aws batch submit-job --job-name "$name" --job-queue "$queue" --job-definition "$definition" \
  --array-properties "size=$shards" --container-overrides "$overrides" --query jobId --output text)
echo "shards: $array_job ($shards tasks)"

finalize=$(printf '{"command":["finalize","%s"]}' "$output")
finalize_job=$(aws batch submit-job --job-name "$name-finalize" --job-queue "$queue" --job-definition "$definition" \
  --depends-on "jobId=$array_job" --container-overrides "$finalize" --query jobId --output text)
echo "finalize: $finalize_job (after $array_job)"
