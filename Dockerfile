# One image, both binaries, nothing else: /leasehold-operator and /leasehold-sidecar, static,
# on scratch, as user 65532. The chart runs the operator from it and the webhook injects the
# sidecar from it.
#
#   docker build -t leasehold/leasehold:0.1.0 .
#
# No Docker engine runs where Leasehold is developed, so this file is not built by the test
# suite. What it runs is: scripts/build-static builds the same two binaries and checks that they
# are static and that the sidecar serves its lock API alone in an empty root. Here the builder
# has the musl target; scripts/build-static picks it when installed, and otherwise links glibc
# statically (x86_64-unknown-linux-gnu with +crt-static), which is what the tests exercise.

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGET=x86_64-unknown-linux-musl
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools binutils \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add "${TARGET}"
WORKDIR /src
COPY . .
ENV LEASEHOLD_STATIC_TARGET_DIR=/target
RUN out="$(scripts/build-static "${TARGET}")" \
 && mkdir /out \
 && cp "$out/leasehold-sidecar" "$out/leasehold-operator" /out/

FROM scratch
COPY --from=build /out/ /
# Non-root; the pod spec adds a read-only root filesystem and drops every capability.
USER 65532:65532
EXPOSE 4040 4041 8080 9443
ENTRYPOINT ["/leasehold-sidecar"]
