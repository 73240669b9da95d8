# coturn from Debian's package, for hosts that cannot pull the coturn/coturn image (compose's
# COTURN_IMAGE): the compose file's `turn` command line is turnserver's arguments, as with the
# official image. tests/test_turn.py runs this same Debian coturn with that command line.
#   docker build -f docker/coturn-debian.Dockerfile -t streamserver-coturn docker
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends coturn \
 && rm -rf /var/lib/apt/lists/*
USER turnserver
EXPOSE 3478/udp 3478/tcp
ENTRYPOINT ["turnserver"]
