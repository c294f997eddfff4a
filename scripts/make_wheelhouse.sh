#!/usr/bin/env bash
# Build a wheelhouse for installing easylm on a cluster with no internet access, then install from it.
#   scripts/make_wheelhouse.sh build PYTHON_VERSION PLATFORM [EXTRA]   (on a machine with internet)
#   scripts/make_wheelhouse.sh install [EXTRA]                         (on the offline machine)
# PYTHON_VERSION like 3.11; PLATFORM a pip platform tag such as manylinux_2_28_x86_64;
# EXTRA an optional extra of easylm such as gpu, tpu or torch. Wheels go to ./wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: make_wheelhouse.sh build PYTHON_VERSION PLATFORM [EXTRA] | install [EXTRA]}
case "$mode" in
  build)
    pyver=${2:?python version, e.g. 3.11}; platform=${3:?platform tag, e.g. manylinux_2_28_x86_64}
    extra=${4:+[$4]}
    # pip takes only the tags it is given: add the older manylinux tags of the same architecture.
    arch=${platform#manylinux_*_*_}; arch=${arch#manylinux2014_}
    platforms="--platform $platform"
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
      platforms="$platforms --platform ${tag}_${arch}"
    done
    # easylm ships as source only: build its (pure-Python) wheel here.
    python3 -m pip wheel --no-deps -w wheelhouse .
    python3 -m pip download -d wheelhouse --find-links wheelhouse --only-binary=:all: \
        --python-version "$pyver" $platforms --platform any "$(ls wheelhouse/easylm-*.whl | head -n 1)${extra}"
    echo "wheelhouse: $(ls wheelhouse | wc -l) files, $(du -sh wheelhouse | cut -f1)";;
  install)
    extra=${2:+[$2]}
    python3 -m pip install --no-index --find-links wheelhouse "easylm${extra}";;
  *) echo "unknown mode $mode (build or install)" >&2; exit 2;;
esac
