#!/bin/sh
# kafka-run-class.sh of the kvstream stand-in image: runs MAIN_CLASS with every jar of /opt/kafka/libs on the
# classpath. Reads KAFKA_HEAP_OPTS, KAFKA_JVM_PERFORMANCE_OPTS, KAFKA_LOG4J_OPTS and KAFKA_OPTS as Kafka's does.
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 MAIN_CLASS [ARGS...]" >&2
    exit 1
fi
main=$1
shift
# shellcheck disable=SC2086  # the *_OPTS variables hold several words
exec java ${KAFKA_HEAP_OPTS:--Xmx256m} ${KAFKA_JVM_PERFORMANCE_OPTS:--Djava.awt.headless=true} \
    ${KAFKA_LOG4J_OPTS:--Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties} ${KAFKA_OPTS:-} \
    -cp "/opt/kafka/libs/*" "$main" "$@"
