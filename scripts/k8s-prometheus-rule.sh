#!/usr/bin/env bash
# Writes config/k8s/base/prometheus-rule.yaml from config/alerts.yml (the one source of the
# alert rules): a PrometheusRule's spec is exactly the rule file's `groups`. The test suite
# fails when the two differ; run this after editing config/alerts.yml.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Generated from config/alerts.yml by scripts/k8s-prometheus-rule.sh; edit that file."
  echo "apiVersion: monitoring.coreos.com/v1"
  echo "kind: PrometheusRule"
  echo "metadata:"
  echo "  name: kvgate"
  echo "  labels:"
  echo "    app.kubernetes.io/part-of: kvgate"
  echo "spec:"
  grep -v '^#' config/alerts.yml | sed -e 's/^\(.\)/  \1/'
} > config/k8s/base/prometheus-rule.yaml
