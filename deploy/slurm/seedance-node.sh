#!/usr/bin/env bash
# What a node's seedance sidecar and the ranks on that node agree on, in one place (train.sbatch
# runs it on every node of the allocation):
#
#   seedance-node.sh job       the name this node's ranks attach as: the Slurm job's name and id
#                              and the node, so it is unique across every sidecar on the state DB
#   seedance-node.sh url       this node's sidecar, on loopback; the port follows the Slurm job id,
#                              so two jobs that share a node do not collide
#   seedance-node.sh config    write this node's sidecar.toml (the shared one, plus tuning for the
#                              node's job) and print its path
#   seedance-node.sh sidecar   run this node's sidecar (exec: one srun task per node)
#   seedance-node.sh wait [S]  wait up to S seconds (default 120) until it answers /readyz
#
# Reads SLURM_JOB_ID, SLURM_JOB_NAME and SLURMD_NODENAME (set by srun on each node), and:
#   SIDECAR_TOML  the settings every node shares (default: sidecar.toml beside this script)
#   SIDECAR_PORT  the port (default: 20000 + SLURM_JOB_ID mod 12000: below the ephemeral range)
#   SIDECAR_DIR   node-local folder for the store (default: $TMPDIR/seedance-$SLURM_JOB_ID)
#   SEEDANCE_TOKEN_FILE  the job's API token: the sidecar's token_file, the ranks' token
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${SLURM_JOB_ID:?run it inside a Slurm job}"

job_name() {
    local name="${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID}-${SLURMD_NODENAME:?run it in a job step (srun)}"
    # a job name is a path segment of the lease API and a TOML key: keep it to safe characters
    printf '%s\n' "${name//[^A-Za-z0-9._-]/_}"
}

port() {
    printf '%s\n' "${SIDECAR_PORT:-$((20000 + SLURM_JOB_ID % 12000))}"
}

local_dir() {
    printf '%s\n' "${SIDECAR_DIR:-${TMPDIR:-/tmp}/seedance-${SLURM_JOB_ID}}"
}

write_config() {
    local dir config
    dir="$(local_dir)"
    config="$dir/sidecar.toml"
    mkdir -p "$dir"
    {
        cat "${SIDECAR_TOML:-$here/sidecar.toml}"
        printf '\n[sidecar.jobs."%s"]\ntune = true\n' "$(job_name)"
    } >"$config"
    printf '%s\n' "$config"
}

run_sidecar() {
    : "${SEEDANCE_TOKEN_FILE:?set it to the token file of the job (train.sbatch writes one)}"
    local config
    config="$(write_config)"
    exec seedancectl sidecar --config "$config" --job "$(job_name)" \
        --listen "127.0.0.1:$(port)" --store "$(local_dir)/metrics.db"
}

wait_ready() {
    local timeout_s="${1:-120}" url
    url="http://127.0.0.1:$(port)/readyz"
    local deadline=$((SECONDS + timeout_s))
    until python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
            "$url" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "seedance-node: the sidecar on ${SLURMD_NODENAME:-$(hostname)} ($url) was not" \
                "ready within ${timeout_s} s; its log is in the job's output" >&2
            return 1
        fi
        sleep 1
    done
}

case "${1:-}" in
    job) job_name ;;
    url) printf 'http://127.0.0.1:%s\n' "$(port)" ;;
    config) write_config ;;
    sidecar) run_sidecar ;;
    wait) wait_ready "${2:-120}" ;;
    *)
        echo "usage: seedance-node.sh job|url|config|sidecar|wait [SECONDS]" >&2
        exit 2
        ;;
esac
