# The bundle of jobs/gpu_check/bundle.py, unpacked on the GPU machine before anything imports Ray. Source it
# from bash (a POSIX sh's `.` passes no arguments):
#
#     . jobs/gpu_check/unpack.sh [BUNDLE (.gpu_bundle)] [TARGET (/tmp/april_ray_bundle)]
#
# Its packages (site.tar.xz) go first on PYTHONPATH, its transformers before the image's; its embedded model
# (model.tar.xz, where carried) under APRIL_RAY_CACHE, where jobs.train finds it instead of building it.
_bundle=${1:-.gpu_bundle}
_target=${2:-/tmp/april_ray_bundle}
if [ ! -f "$_bundle/site.tar.xz" ]; then
    echo "unpack.sh: $_bundle/site.tar.xz not found (python -m jobs.gpu_check.bundle --out $_bundle makes it)" >&2
    return 1 2>/dev/null || exit 1
fi
mkdir -p "$_target" &&
    python3 -c 'import sys, tarfile
for a in sys.argv[2:]: tarfile.open(a).extractall(sys.argv[1], filter="data")' \
        "$_target" "$_bundle"/*.tar.xz || { return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$_target/site${PYTHONPATH:+:$PYTHONPATH}"
export APRIL_RAY_CACHE="$_target/cache"
unset _bundle _target
