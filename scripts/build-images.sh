#!/usr/bin/env bash
# Build Loraplex's images from the Dockerfile and, optionally, load them into a local cluster.
#
# Usage: scripts/build-images.sh [options] [ROLE ...]      ROLE: router operator agent agent-cpu
#                                                           (default: router operator agent-cpu)
#   --tool docker|buildah     builder (default: docker if it answers, else buildah)
#   --repository REPO         image repository (default: ghcr.io/loraplex); images are
#                             REPO/loraplex-ROLE:TAG
#   --tag TAG                 default: the chart's appVersion (helm/loraplex/Chart.yaml)
#   --base IMAGE              the Python base image (default: the Dockerfile's python:3.11-slim-bookworm),
#                             e.g. a registry mirror or an air-gapped stand-in
#   --build-arg KEY=VALUE     passed to every build (e.g. TORCH_INDEX_URL=... for a package mirror)
#   --builder-flag FLAG       passed to the builder verbatim (e.g. --builder-flag --network=host)
#   --load kind|minikube|containerd   load the built images into that cluster's runtime
#                             (containerd: `ctr -n k8s.io images import`, as root on the node)
#   --kind-cluster NAME       kind cluster name for --load kind (default: kind)
# Prints one line per image: name, size, seconds to build. Any failed build stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "build-images: $*" >&2; exit 2; }

tool="" repository="ghcr.io/loraplex" tag="" base="" load="" kind_cluster="kind"
build_args=() roles=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tool) tool=${2:?}; shift 2 ;;
    --repository) repository=${2:?}; shift 2 ;;
    --tag) tag=${2:?}; shift 2 ;;
    --base) base=${2:?}; shift 2 ;;
    --build-arg) build_args+=(--build-arg "${2:?}"); shift 2 ;;
    --builder-flag) build_args+=("${2:?}"); shift 2 ;;
    --load) load=${2:?}; shift 2 ;;
    --kind-cluster) kind_cluster=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    router|operator|agent|agent-cpu) roles+=("$1"); shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ ${#roles[@]} -gt 0 ]] || roles=(router operator agent-cpu)
[[ -n "$tag" ]] || tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' helm/loraplex/Chart.yaml)
[[ -n "$tag" ]] || die "no appVersion in helm/loraplex/Chart.yaml; pass --tag"
[[ -n "$base" ]] && build_args+=(--build-arg "PYTHON_IMAGE=$base")
if [[ -z "$tool" ]]; then
  if docker info >/dev/null 2>&1; then tool=docker
  elif command -v buildah >/dev/null; then tool=buildah
  else die "neither a running docker nor buildah found; install one or pass --tool"; fi
fi
case "$tool" in
  docker) build=(docker build) ;;
  buildah) build=(buildah bud --layers) ;;
  *) die "--tool must be docker or buildah, not '$tool'" ;;
esac
case "$load" in
  ""|kind|minikube|containerd) ;;
  *) die "--load must be kind, minikube or containerd, not '$load'" ;;
esac

image_size() { "$tool" images --format '{{.Size}}' "$1" | head -n 1; }

load_image() {
  local image=$1 archive
  case "$load" in
    kind) [[ "$tool" == docker ]] || die "--load kind needs --tool docker"
          kind load docker-image --name "$kind_cluster" "$image" ;;
    minikube) if [[ "$tool" == docker ]]; then minikube image load "$image"
              else archive=$(mktemp --suffix .tar); buildah push -q "$image" "docker-archive:$archive:$image" >/dev/null
                   minikube image load "$archive"; rm -f "$archive"; fi ;;
    containerd) archive=$(mktemp --suffix .tar)
                if [[ "$tool" == docker ]]; then docker save -o "$archive" "$image"
                else buildah push -q "$image" "docker-archive:$archive:$image" >/dev/null; fi
                ctr -n k8s.io images import "$archive" >/dev/null; rm -f "$archive" ;;
  esac
}

for role in "${roles[@]}"; do
  image="$repository/loraplex-$role:$tag"
  started=$SECONDS
  echo "building $image (target $role, $tool)" >&2
  "${build[@]}" "${build_args[@]}" --target "$role" -t "$image" -f Dockerfile . >&2 \
    || die "building $image failed (the output above says where)"
  printf '%s\t%s\t%ss\n' "$image" "$(image_size "$image")" "$((SECONDS - started))"
  if [[ -n "$load" ]]; then load_image "$image"; echo "loaded $image into $load" >&2; fi
done
