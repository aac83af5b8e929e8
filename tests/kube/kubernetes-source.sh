# Sourced by the scripts that build from Debian's `kubernetes` source package (1.20, with
# vendor/): fetches and unpacks it offline into $1/src, through a private apt configuration with a
# deb-src line, so the machine's own sources stay untouched. Also downloads any binary packages
# named after $1 into $1.
kubernetes_source() { # $1: work dir, then binary packages to download beside it
  local work=$1 suite
  shift
  mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial"
  suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  cat >"$work/apt/sources.list" <<SRC
deb-src http://deb.debian.org/debian $suite main
deb-src http://deb.debian.org/debian-security $suite-security main
deb http://deb.debian.org/debian $suite main
deb http://deb.debian.org/debian-security $suite-security main
SRC
  local apt_private=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
                     -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache::Archives=$work/apt/archives"
                     -o "APT::Sandbox::User=root")
  apt-get "${apt_private[@]}" -q update >&2
  (cd "$work" && apt-get "${apt_private[@]}" -q source --download-only kubernetes >&2)
  if (($#)); then
    (cd "$work" && apt-get "${apt_private[@]}" -q download "$@" >&2)
  fi
  (cd "$work" && dpkg-source --no-check -x kubernetes_*.dsc src >&2)

  # The vendored reflect2 1.0.1 crashes under Go >= 1.18 as soon as an object with labels is
  # served; Debian's 1.0.2 is the fixed release.
  local vendored=$work/src/vendor/github.com/modern-go/reflect2
  find "$vendored" -maxdepth 1 \( -name '*.go' -o -name '*.s' \) -delete
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$vendored/"
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$vendored/" 2>/dev/null || true
  find "$vendored" -maxdepth 1 -name '*_test.go' -delete
}

# Installs the Debian packages the builds need when they are missing (as root), or says how.
kubernetes_build_deps() { # $1: the calling script, for the message
  local need=(golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev make gcc libc6-dev)
  local missing=() p
  for p in "${need[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "$(basename "$1"): missing ${missing[*]}; run as root: sudo $1" >&2
    return 1
  fi
  echo "$(basename "$1"): installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}
