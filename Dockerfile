# The kvgate image the Kubernetes manifests run (config/k8s): one binary for the gateway and
# the replica, with Qwen3's tokenizer files (what the sim replicas and the gateway tokenise
# with by default).   docker build -t kvgate:latest .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake npm && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin kvgate && scripts/fetch-models.sh --tokenizer-only

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 kvgate
COPY --from=build /src/target/release/kvgate /usr/local/bin/kvgate
COPY --from=build /src/models/qwen3 /opt/kvgate/models/qwen3
COPY --from=build /src/config /opt/kvgate/config
ENV KVGATE_TOKENIZER_DIR=/opt/kvgate/models/qwen3
USER 10001
ENTRYPOINT ["kvgate"]
CMD ["--help"]
