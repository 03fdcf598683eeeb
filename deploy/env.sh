# Sourced by the project's scripts: the environment epserve's processes run in.
# Open MPI refuses root without these; small machines need oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# One PoCL thread per rank unless told otherwise, so ranks do not fight over the cores.
export POCL_MAX_PTHREAD_COUNT="${POCL_MAX_PTHREAD_COUNT:-1}"
