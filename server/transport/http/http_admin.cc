#include "server/transport/http/http_admin.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "httplib.h"
#include "server/transport/address.h"
#include "server/transport/figures.h"

namespace shardcast {
namespace {

constexpr size_t kHttpThreads = 32;

}  // namespace

absl::StatusOr<std::unique_ptr<HttpAdmin>> HttpAdmin::Start(
    const std::string& address, std::function<absl::Status()> health,
    std::function<std::vector<Figure>()> figures) {
  std::unique_ptr<HttpAdmin> h(new HttpAdmin());
  h->server_ = std::make_unique<httplib::Server>();
  // A connection holds one of a bounded set of threads for as long as it
  // sends or reads within the timeouts: idle or stalled clients are cut off
  // after kIoTimeout, so a few of them cannot keep /healthz from answering.
  constexpr time_t kIoTimeout = 2;  // seconds
  h->server_->new_task_queue = [] {
    return new httplib::ThreadPool(kHttpThreads);
  };
  h->server_->set_read_timeout(kIoTimeout);
  h->server_->set_write_timeout(kIoTimeout);
  h->server_->set_keep_alive_timeout(kIoTimeout);
  h->server_->set_keep_alive_max_count(16);
  h->server_->set_payload_max_length(64 << 10);  // nothing is posted here
  h->server_->Get(
      "/healthz", [health = std::move(health)](const httplib::Request&,
                                               httplib::Response& res) {
        const absl::Status why = health();
        res.status = why.ok() ? 200 : 503;
        res.set_content(
            why.ok() ? std::string("ok\n") : absl::StrCat(why.message(), "\n"),
            "text/plain");
      });
  h->server_->Get(
      "/metrics", [figures = std::move(figures)](const httplib::Request&,
                                                 httplib::Response& res) {
        res.set_content(PrometheusText(figures()), "text/plain; version=0.0.4");
      });
  const std::string host = HostOf(address);
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http ", address, " is not host:port"));
  }
  if (port == 0) {
    port = h->server_->bind_to_any_port(host);
  } else if (!h->server_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on HTTP ", address));
  }
  h->port_ = port;
  httplib::Server* server = h->server_.get();
  h->thread_ = std::thread([server] { server->listen_after_bind(); });
  LogInfo("HTTP admin on ", host, ":", port, " (/healthz, /metrics)");
  return h;
}

HttpAdmin::~HttpAdmin() { Stop(); }

void HttpAdmin::Stop() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace shardcast
