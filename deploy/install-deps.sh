#!/usr/bin/env bash
# Installs the Debian bookworm packages shardcast builds, tests and runs with.
# Safe to re-run. Needs root (or sudo).
set -euo pipefail

packages=(
  # toolchain (clang: the thread-safety analysis of tests/run.sh; its
  # libFuzzer runtime for tests/fuzz)
  g++ clang libclang-rt-14-dev cmake make pkg-config
  # libraries
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev
  libabsl-dev nlohmann-json3-dev libssl-dev liburing-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev
  # Python tests and the Python package (Debian's /usr/bin/python3)
  python3 python3-numpy python3-pytest python3-grpcio python3-protobuf
  python3-torch python3-matplotlib
  # what saev's own code imports (../shared/peers/saev: the reference that
  # tests/python/package/test_package_saev_compat.py runs beside ours)
  python3-torchvision python3-pil python3-psutil python3-cloudpickle
  python3-scipy
  # benchmarks and tests: sha256sum (coreutils), fio, vmtouch
  coreutils openssl fio vmtouch
  # tests of deploy/: shellcheck, systemd-analyze (systemd), strace (the
  # unit's system-call filter), PyYAML (the Kubernetes manifests)
  shellcheck systemd strace python3-yaml
  # the /metrics page and the Grafana dashboard's queries checked with the
  # real tools (promtool, a Prometheus server)
  prometheus
)

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then
    exec sudo --preserve-env=DEBIAN_FRONTEND "$0" "$@"
  fi
  echo "install-deps.sh: run as root (apt-get needs it)" >&2
  exit 1
fi

# Skip apt entirely when everything is present (fast re-runs, offline use).
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
