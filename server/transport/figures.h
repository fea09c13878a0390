// Every figure the daemon exports, declared once (figures.cc): its
// Prometheus name, kind, unit, help, label names and how it is read. The
// outputs are collected from those declarations: /metrics renders them
// (PrometheusText), Admin.GetStatus sends them (ServerStatus.figures) and
// the clients print what they get; none of them names a figure itself.
#ifndef SHARDCAST_SERVER_TRANSPORT_FIGURES_H_
#define SHARDCAST_SERVER_TRANSPORT_FIGURES_H_

#include <string>
#include <vector>

#include "server/engine/engine_status.h"
#include "server/transport/grpc/local_acceptor.h"
#include "server/transport/local/shm_service.h"
#include "server/transport/metrics.h"

namespace shardcast {

enum class FigureKind { kCounter, kGauge };

/// "counter" or "gauge" (Prometheus' TYPE).
const char* FigureKindName(FigureKind kind);

/// One sample of a figure: the values of its labels (in the order of the
/// figure's label names) and the value.
struct FigureSample {
  std::vector<std::string> labels;
  double value = 0;
};

/// A figure and its samples at one moment.
struct Figure {
  const char* name;  // Prometheus name: base-unit suffix, _total on counters
  FigureKind kind;
  const char* unit;  // "bytes", "seconds", or "" for a count
  const char* help;
  std::vector<const char*> label_names;
  std::vector<FigureSample> samples;  // none: the family is empty now
};

/// What the figures are read from, at one moment.
struct FigureSources {
  bool serving = false;
  const Metrics* metrics = nullptr;       // required
  const EngineFigures* engine = nullptr;  // required
  ShmFigures shm;                         // zeros without shared memory
  LocalAcceptorFigures local;             // zeros without the Unix socket
};

/// Every declared figure, in declaration order, with its samples now.
std::vector<Figure> CollectFigures(const FigureSources& sources);

/// The Prometheus text exposition format (version 0.0.4) of `figures`: one
/// HELP and TYPE line per figure, then its samples, label values escaped.
std::string PrometheusText(const std::vector<Figure>& figures);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_FIGURES_H_
