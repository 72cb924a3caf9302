# Sourced by the sbatch scripts: the site's modules and virtualenv, then the launcher
# as the array "launch" (srun, or mpiexec with the job's task count).
#   MPICOLL_MODULES  modules to 'module load' first, e.g. "openmpi/4.1.5 python/3.11"
#   MPICOLL_VENV     virtualenv to activate (where mpicoll and mpi4py are installed)
#   MPICOLL_LAUNCHER srun (default) or mpiexec
#   MPICOLL_SRUN_ARGS srun's arguments, e.g. "--mpi=pmix"; default: the PMI plugin that speaks this MPI's
#                     language, when this Slurm has it (--mpi=pmi2 for MPICH and the MPICH wheel, --mpi=pmix for
#                     Open MPI).  Slurm's own default (MpiDefault, often "none") starts every task as a separate
#                     one-rank MPI job; mpicoll refuses such a launch in one line naming the fix.
if [ -n "${MPICOLL_MODULES:-}" ]; then
    # shellcheck disable=SC2086
    module load $MPICOLL_MODULES
fi
if [ -n "${MPICOLL_VENV:-}" ]; then
    # shellcheck disable=SC1091
    source "$MPICOLL_VENV/bin/activate"
fi
command -v mpicoll >/dev/null || { echo "mpicoll is not installed here: set MPICOLL_VENV" >&2; exit 2; }
case ${MPICOLL_LAUNCHER:-srun} in
    srun)
        if [ -z "${MPICOLL_SRUN_ARGS+set}" ]; then
            # The first line from Python itself: piped into 'head -1', Python now and then met a closed pipe,
            # and under 'set -o pipefail' that ended the job in silence (exit 1, an empty log; 2 in 200).
            library=$(python -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null) || library=""
            case $library in
                *"Open MPI"*) plugin=pmix ;;
                *) plugin=pmi2 ;;         # MPICH and its kin (the MPICH wheel, Intel MPI, MVAPICH, Cray MPICH)
            esac
            MPICOLL_SRUN_ARGS=""
            # grep reads the whole list (no -q): srun must not meet a closed pipe either.
            if srun --mpi=list 2>&1 | grep -w "$plugin" >/dev/null; then MPICOLL_SRUN_ARGS="--mpi=$plugin"; fi
        fi
        read -r -a srun_args <<< "$MPICOLL_SRUN_ARGS"
        launch=(srun "${srun_args[@]}") ;;
    mpiexec)
        launch=(mpiexec -n "${SLURM_NTASKS:?run under sbatch or set SLURM_NTASKS}") ;;
    *)
        echo "MPICOLL_LAUNCHER must be srun or mpiexec, got '${MPICOLL_LAUNCHER}'" >&2; exit 2 ;;
esac
echo "nodes: ${SLURM_JOB_NODELIST:-?}  ranks: ${SLURM_NTASKS:-?}  launcher: ${launch[*]}  started: $(date -Is)"
