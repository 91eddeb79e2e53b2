#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU machine lacks (bench/gpu_wheels.txt) into .whl/ (gitignored),
# for Python 3.12 on x86-64 Linux. The run tool carries .whl (carry: [".whl"]) and bench/gpu_suite.sh installs them
# there with pip --no-index. Keeps exactly one version of each package and stays under 60 MiB, since the working tree
# and carried paths travel under a 64 MiB cap.
#
# Usage: bench/fetch_wheels.sh [DIR]      (default DIR: .whl in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
list=bench/gpu_wheels.txt
limit_mib=60
py="${PYTHON:-python3}"
mkdir -p "$dir"

# one version per package: drop wheels of a listed package whose version is not the pinned one
while read -r spec; do
    name="${spec%%==*}"
    version="${spec##*==}"
    stem="$(echo "$name" | tr '-' '_')"
    for f in "$dir"/"$stem"-*.whl; do
        [ -e "$f" ] || continue
        case "$(basename "$f")" in
            "$stem-$version-"*) ;;
            *) echo "removing $(basename "$f") (pinned: $version)"; rm -f "$f" ;;
        esac
    done
done < <(grep -Ev '^\s*(#|$)' "$list")

# manylinux_2_N tags are matched exactly, so name the ones these packages publish
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform linux_x86_64 \
    -d "$dir" -r "$list"

count=$(ls "$dir"/*.whl | wc -l)
expected=$(grep -Evc '^\s*(#|$)' "$list")
if [ "$count" -ne "$expected" ]; then
    ls -l "$dir"
    echo "expected $expected wheels in $dir, found $count" >&2
    exit 1
fi
total=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
ls -l "$dir"/*.whl | awk '{printf "  %8.1f MiB  %s\n", $5 / 1048576, $9}'
printf '%d wheels, %.1f MiB in %s (limit %d MiB)\n' "$count" "$(echo "$total / 1048576" | bc -l)" "$dir" "$limit_mib"
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
    echo "wheels exceed $limit_mib MiB: the working tree and carried paths travel under a 64 MiB cap" >&2
    exit 1
fi
