# RabbitMQ from Debian's rabbitmq-server (3.10 on bookworm), in place of rabbitmq:3.13-management
# where Docker Hub cannot be reached (deploy/base-images.sh). It behaves as the official image does
# where compose.yaml relies on it: node rabbit@<hostname>, data in /var/lib/rabbitmq, every
# /etc/rabbitmq/conf.d/*.conf read, the management plugin on, logs on stdout, the server in the
# foreground as the rabbitmq user; compose.yaml's healthcheck (rabbitmq-diagnostics) works as is.
ARG DEBIAN_IMAGE=baton-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends rabbitmq-server \
    && rm -rf /var/lib/apt/lists/* \
    && rabbitmq-plugins enable --offline rabbitmq_management \
    && mkdir -p /etc/rabbitmq/conf.d \
    && printf '%s\n' 'listeners.tcp.default = 5672' 'management.tcp.port = 15672' \
       >/etc/rabbitmq/conf.d/10-defaults.conf \
    && : >/etc/rabbitmq/rabbitmq-env.conf \
    && chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /etc/rabbitmq
# Logs to stdout (docker logs), not /var/log/rabbitmq.
ENV RABBITMQ_LOGS=-
USER rabbitmq
WORKDIR /var/lib/rabbitmq
EXPOSE 4369 5672 15672 25672
HEALTHCHECK --interval=5s --timeout=15s --start-period=20s --retries=24 \
    CMD ["rabbitmq-diagnostics", "-q", "check_port_connectivity"]
CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
