#!/usr/bin/env bash
# A local single-node Apache Kafka 4.x broker (KRaft, no Docker) for the tests.
#
#   scripts/kafka_local.sh start [--fresh] [--sasl-ssl]  # fetch the jars once, start, wait until ready
#   scripts/kafka_local.sh status           # exit 0 when a broker answers on the port
#   scripts/kafka_local.sh stop             # SIGTERM, then SIGKILL after a timeout; no-op when not running
#
# The broker jars come from Maven Central through scripts/kafka/pom.xml into
# a cache outside the clone ($SPIKEGUARD_CACHE/kafka/lib, ~/.m2 keeps the
# downloads). A restart keeps the data directory (topics, offsets, worker
# snapshots), as a real broker's restart does; only `start --fresh` wipes it
# first, which scripts/test.sh uses so that a test run begins empty.
#
# --sasl-ssl adds a SASL_SSL listener (SCRAM-SHA-512 over TLS) on
# $SPIKEGUARD_KAFKA_SASL_PORT, next to the PLAINTEXT one. Its certificates
# are made with openssl on first use in $SPIKEGUARD_KAFKA_TLS_DIR: a CA
# (ca.pem, what clients trust) and a broker certificate for 127.0.0.1 and
# localhost. SCRAM users are created by an admin client over the PLAINTEXT
# listener (loopback only), e.g. kafka-python's alter_user_scram_credentials.
#
# Environment:
#   SPIKEGUARD_KAFKA_PORT             client port (default 9092)
#   SPIKEGUARD_KAFKA_CONTROLLER_PORT  KRaft controller port (default 9093)
#   SPIKEGUARD_KAFKA_HEAP             JVM heap flags (default "-Xms256m -Xmx512m")
#   SPIKEGUARD_KAFKA_JVM_FLAGS        further JVM flags of the broker (default none); a broker
#                                     that lives for one test starts faster and with about half
#                                     the CPU on "-XX:TieredStopAtLevel=1"
#   SPIKEGUARD_KAFKA_START_TIMEOUT    seconds to wait for the broker (default 90)
#   SPIKEGUARD_KAFKA_STOP_TIMEOUT     seconds between SIGTERM and SIGKILL (default 30)
#   SPIKEGUARD_KAFKA_SASL_PORT        SASL_SSL port with --sasl-ssl (default client port + 2)
#   SPIKEGUARD_KAFKA_TLS_DIR          certificates for --sasl-ssl (default <run dir>/tls)
#   SPIKEGUARD_CACHE                  cache root (default ~/.cache/spikeguard)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
kdir="$here/kafka"
cache="${SPIKEGUARD_CACHE:-$HOME/.cache/spikeguard}"
lib="$cache/kafka/lib"
host=127.0.0.1
port="${SPIKEGUARD_KAFKA_PORT:-9092}"
cport="${SPIKEGUARD_KAFKA_CONTROLLER_PORT:-9093}"
heap="${SPIKEGUARD_KAFKA_HEAP:--Xms256m -Xmx512m}"
jvm_flags="${SPIKEGUARD_KAFKA_JVM_FLAGS:-}"
start_timeout="${SPIKEGUARD_KAFKA_START_TIMEOUT:-90}"
stop_timeout="${SPIKEGUARD_KAFKA_STOP_TIMEOUT:-30}"
run="$cache/kafka/run-$port"
sport="${SPIKEGUARD_KAFKA_SASL_PORT:-$((port + 2))}"
tls="${SPIKEGUARD_KAFKA_TLS_DIR:-$run/tls}"
sasl_ssl=0
pidfile="$run/kafka.pid"
logs="$run/logs"

say() { echo "kafka_local: $*" >&2; }
die() { say "error: $*"; exit 1; }

# The venv's python, when it has kafka-python, checks readiness with a real client.
python=""
for candidate in "${SPIKEGUARD_PYTHON:-}" "$cache/venv/bin/python"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import kafka" 2>/dev/null; then
    python="$candidate"
    break
  fi
done

tcp_open() { (exec 3<>"/dev/tcp/$host/$1") 2>/dev/null; }

# Exit 0 when a broker on $port serves clients within $1 seconds.
probe() {
  if [ -n "$python" ]; then
    "$python" "$kdir/ready.py" "$host:$port" "$1" 2>/dev/null
  else
    tcp_open "$port"
  fi
}

our_pid() {
  local pid
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  [ -n "$pid" ] && grep -qa "kafka.Kafka" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

java_opts() {
  # shellcheck disable=SC2206  # the heap flags are meant to split
  local opts=($heap $jvm_flags -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
    -Djava.awt.headless=true "-Dlog4j2.configurationFile=$kdir/log4j2.properties"
    "-Dkafka.logs.dir=$logs" -cp "$lib/*")
  printf '%s\n' "${opts[@]}"
}

# What `StorageTool random-uuid` prints (16 random bytes, URL-safe base64 without padding,
# never starting with "-"), without starting a JVM for it.
random_cluster_id() {
  local id="-"
  while [ "${id:0:1}" = "-" ]; do
    id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
  done
  echo "$id"
}

fetch_jars() {
  local want
  want="$(sha256sum "$kdir/pom.xml" | cut -d' ' -f1)"
  if [ "$(cat "$lib/.pom.sha256" 2>/dev/null || true)" = "$want" ]; then
    return
  fi
  command -v mvn >/dev/null || die "mvn not found (Maven fetches the broker jars)"
  command -v java >/dev/null || die "java not found (the broker needs Java 17+)"
  say "fetching the broker jars into $lib (once)"
  rm -rf "$lib.tmp"
  mvn -B -q -Dstyle.color=never -f "$kdir/pom.xml" dependency:copy-dependencies \
    -DoutputDirectory="$lib.tmp" >&2 || die "mvn could not fetch the broker jars"
  rm -rf "$kdir/target" "$lib"
  mv "$lib.tmp" "$lib"
  echo "$want" > "$lib/.pom.sha256"
}

# A throwaway CA and a broker certificate (SAN 127.0.0.1, localhost) in a
# PKCS12 keystore whose random password stays in the directory (mode 600).
make_certs() {
  [ -s "$tls/broker.p12" ] && [ -s "$tls/ca.pem" ] && [ -s "$tls/keystore.password" ] && return
  command -v openssl >/dev/null || die "openssl not found (it makes the test certificates)"
  mkdir -p "$tls"
  chmod 700 "$tls"
  local pw
  pw="$(openssl rand -hex 16)"
  (
    cd "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 7 \
      -subj "/CN=spikeguard-test-ca"
    openssl req -newkey rsa:2048 -nodes -keyout broker.key -out broker.csr -subj "/CN=localhost"
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > san.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out broker.pem \
      -days 7 -extfile san.ext
    openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -out broker.p12 \
      -passout "pass:$pw"
  ) >>"$logs/tls.log" 2>&1 || die "openssl could not make the certificates (see $logs/tls.log)"
  (umask 077; echo "$pw" > "$tls/keystore.password")
}

write_config() {
  local listeners="PLAINTEXT://$host:$port" protocols="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
  if [ "$sasl_ssl" = 1 ]; then
    listeners="$listeners,SASL_SSL://$host:$sport"
    protocols="$protocols,SASL_SSL:SASL_SSL"
  fi
  cat > "$run/server.properties" <<EOF
# Written by scripts/kafka_local.sh: one KRaft node for tests, on $host only.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$host:$cport
listeners=$listeners,CONTROLLER://$host:$cport
advertised.listeners=$listeners
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
log.dirs=$run/data

num.partitions=4
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

# Fast group changes: no initial delay, and tests may use short sessions.
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000

# Small segments and little housekeeping (test data; start --fresh wipes it).
log.segment.bytes=16777216
log.retention.hours=24
log.retention.check.interval.ms=60000
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
EOF
  if [ "$sasl_ssl" = 1 ]; then
    cat >> "$run/server.properties" <<EOF

# SASL_SSL: SCRAM-SHA-512 users (made through the admin API) over TLS.
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location=$tls/broker.p12
listener.name.sasl_ssl.ssl.keystore.password=$(cat "$tls/keystore.password")
listener.name.sasl_ssl.ssl.client.auth=none
EOF
  fi
}

start() {
  local fresh=0 arg
  for arg in "$@"; do
    case "$arg" in
      --fresh) fresh=1 ;;
      --sasl-ssl) sasl_ssl=1 ;;
      *) echo "usage: $0 start [--fresh] [--sasl-ssl]  (unknown option $arg)" >&2; exit 2 ;;
    esac
  done
  local pid
  if pid="$(our_pid)"; then
    [ "$fresh" = 0 ] || die "--fresh asked, but the broker (pid $pid) is running: stop it first"
    probe "$start_timeout" || die "broker pid $pid runs but does not answer on $host:$port (see $logs/server.log)"
    say "already running (pid $pid) at $host:$port"
    return 0
  fi
  if tcp_open "$port"; then
    if probe 10; then
      say "a broker is already running at $host:$port (not started by this script)"
      return 0
    fi
    die "port $port is in use by something that is not a Kafka broker"
  fi
  tcp_open "$cport" && die "controller port $cport is in use (set SPIKEGUARD_KAFKA_CONTROLLER_PORT)"
  if [ "$sasl_ssl" = 1 ] && tcp_open "$sport"; then
    die "SASL_SSL port $sport is in use (set SPIKEGUARD_KAFKA_SASL_PORT)"
  fi

  fetch_jars
  local t0=$SECONDS
  if [ "$fresh" = 1 ]; then
    rm -rf "$run"
  fi
  mkdir -p "$run/data" "$logs"
  [ "$sasl_ssl" = 0 ] || make_certs
  write_config
  local opts cluster_id
  mapfile -t opts < <(java_opts)
  # Formatting is what makes storage empty: only a data dir never formatted
  # (first start, or after --fresh) gets it; a restart keeps its cluster.
  if [ ! -s "$run/data/meta.properties" ]; then
    cluster_id="$(random_cluster_id)"
    # A one-shot tool: the JIT's second tier costs more than it saves here.
    java "${opts[@]}" -XX:TieredStopAtLevel=1 kafka.tools.StorageTool format --standalone \
      -t "$cluster_id" \
      -c "$run/server.properties" >>"$logs/stdout.log" 2>&1 \
      || die "StorageTool format failed: $(tail -n 20 "$logs/stdout.log")"
  else
    say "keeping the data in $run/data (use 'start --fresh' to begin empty)"
  fi
  # The broker gets its own session (a Ctrl-C or the end of the calling job
  # does not reach it) and writes its own pid: setsid may fork, so $! is not it.
  setsid nohup bash -c 'echo $$ > "$0"; exec "$@"' "$pidfile" \
    java "${opts[@]}" kafka.Kafka "$run/server.properties" >>"$logs/stdout.log" 2>&1 < /dev/null &
  pid=""
  for _ in $(seq 50); do
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    [ -n "$pid" ] && break
    sleep 0.1
  done
  [ -n "$pid" ] || fail_start "the broker did not start"
  say "started pid $pid, waiting for $host:$port (up to ${start_timeout}s)"

  local deadline=$((SECONDS + start_timeout)) left
  while true; do
    kill -0 "$pid" 2>/dev/null || fail_start "the broker exited"
    left=$((deadline - SECONDS))
    [ "$left" -gt 0 ] || fail_start "not ready after ${start_timeout}s"
    probe "$((left < 5 ? left : 5))" && break
    sleep 0.5
  done
  [ -n "$python" ] || say "note: checked the TCP port only (no venv with kafka-python at $cache/venv)"
  say "ready at $host:$port (pid $pid) in $((SECONDS - t0))s; logs in $logs"
  [ "$sasl_ssl" = 0 ] || say "SASL_SSL (SCRAM-SHA-512) at $host:$sport; clients trust $tls/ca.pem"
}

fail_start() {
  say "error: $1"
  for f in "$logs/server.log" "$logs/stdout.log"; do
    [ -s "$f" ] || continue
    say "--- tail of $f"
    tail -n 40 "$f" >&2
  done
  stop >/dev/null 2>&1 || true
  exit 1
}

stop() {
  local pid
  if ! pid="$(our_pid)"; then
    rm -f "$pidfile"
    if tcp_open "$port"; then
      say "something answers on $host:$port but was not started by this script; left alone"
      return 1
    fi
    say "not running"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + stop_timeout))
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    say "pid $pid still running after ${stop_timeout}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -f "$pidfile"
  say "stopped (pid $pid)"
}

status() {
  local pid
  pid="$(our_pid || true)"
  if tcp_open "$port" && probe 5; then
    say "running at $host:$port${pid:+ (pid $pid)}"
    return 0
  fi
  if [ -n "$pid" ]; then
    say "pid $pid runs but does not answer on $host:$port yet"
  else
    say "not running"
  fi
  return 1
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start [--fresh] [--sasl-ssl]|stop|status" >&2; exit 2 ;;
esac
