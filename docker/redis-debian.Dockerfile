# Redis from Debian's package, for hosts that cannot pull the official redis image (compose's
# REDIS_IMAGE): the same `redis-server ...` command, data in /data, run as the redis user.
#   docker build -f docker/redis-debian.Dockerfile -t streamserver-redis docker
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--appendonly", "yes"]
