// Every figure the daemon exports, declared once (figures.cc): its
// Prometheus name, kind, unit, help, label names and how it is read. The
// outputs are collected from those declarations: /metrics renders them
// (PrometheusText), Admin.GetStatus sends them (ServerStatus.figures) and
// the clients print what they get; none of them names a figure itself.
#ifndef SHARDCAST_SERVER_TRANSPORT_FIGURES_H_
#define SHARDCAST_SERVER_TRANSPORT_FIGURES_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "server/engine/engine_status.h"
#include "server/transport/local_peer.h"
#include "server/transport/metrics.h"

namespace shardcast {

/// The Unix socket's figures (grpc/local_acceptor.h).
struct LocalAcceptorFigures {
  int64_t connections = 0;      // admitted and still open
  int64_t refused_busy = 0;     // over the cap, since start
  int64_t refused_denied = 0;   // not an allowed uid/gid, since start
  int64_t accept_failures = 0;  // accept() errors (EMFILE...), since start
  bool starved = false;         // accept() is failing right now
  /// SO_SNDBUF of the last connection accepted, as the kernel reports it
  /// (twice the size in use: socket(7)); 0 before the first.
  int64_t send_buffer_bytes = 0;
  std::vector<LocalPeer> peers;  // of the open connections
};

/// The batch regions' figures (local/batch_regions.h).
struct ShmFigures {
  int64_t regions = 0;   // mapped (attached or attachable)
  uint64_t bytes = 0;    // their size
  int64_t attached = 0;  // in use by a stream
};

/// A sweep peer's traffic (grpc/peer.h), by its --sweep-peer address.
struct PeerFigures {
  std::string peer;
  uint64_t received_bytes = 0;  // its share's blocks, fetched from it
  uint64_t sent_bytes = 0;      // this node's share, sent to it
};

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
  std::vector<PeerFigures> peers;         // a sweep's (none without)
};

/// Every declared figure, in declaration order, with its samples now.
std::vector<Figure> CollectFigures(const FigureSources& sources);

/// The Prometheus text exposition format (version 0.0.4) of `figures`: one
/// HELP and TYPE line per figure, then its samples, label values escaped.
std::string PrometheusText(const std::vector<Figure>& figures);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_FIGURES_H_
