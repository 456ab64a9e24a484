#!/bin/sh
# kafka-server-start.sh of the kvstream stand-in image: the broker in the foreground, with Kafka's own heap and
# G1 defaults (kafka-server-start.sh and kafka-run-class.sh of the distribution).
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 server.properties" >&2
    exit 1
fi
export KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G}"
export KAFKA_JVM_PERFORMANCE_OPTS="${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true}"
export KAFKA_LOG4J_OPTS="${KAFKA_LOG4J_OPTS:--Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties}"
exec "$(dirname "$0")/kafka-run-class.sh" kafka.Kafka "$@"
