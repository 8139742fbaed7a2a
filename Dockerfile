# One image, both binaries and the CA roots, nothing else: /leasehold-operator and
# /leasehold-sidecar, static, on scratch, as user 65532, with Debian's CA bundle at
# /etc/ssl/certs/ca-certificates.crt, where both look for the system's roots (`tls: true`
# without a CA of its own, as managed services need). The chart runs the operator from it and
# the webhook injects the sidecar from it.
#
#   docker build -t registry.example/leasehold/leasehold:0.1.0 .
#
# The last stage is also built without a registry by scripts/build-image (the test suite runs
# it): podman builds it from the static binaries of scripts/build-static, writes an OCI archive
# and checks it. Keep the last stage FROM scratch with its `COPY --from=build /out/ /`, which
# that script replaces. The musl target is used when the builder has it; scripts/build-static
# otherwise links glibc statically (x86_64-unknown-linux-gnu with +crt-static).

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGET=x86_64-unknown-linux-musl
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools binutils ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add "${TARGET}"
WORKDIR /src
COPY . .
ENV LEASEHOLD_STATIC_TARGET_DIR=/target
RUN out="$(scripts/build-static "${TARGET}")" \
 && mkdir -p /out/etc/ssl/certs \
 && cp "$out/leasehold-sidecar" "$out/leasehold-operator" /out/ \
 && cp /etc/ssl/certs/ca-certificates.crt /out/etc/ssl/certs/

FROM scratch
COPY --from=build /out/ /
# Non-root; the pod spec adds a read-only root filesystem and drops every capability.
USER 65532:65532
EXPOSE 4040 4041 8080 9443
ENTRYPOINT ["/leasehold-sidecar"]
