#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/query_session_internal.h"
#include "proto/grpc_status.h"

namespace shardcast {
namespace internal_client {

QuerySession::~QuerySession() {
  std::shared_ptr<Stream> s;
  {
    MutexLock lock(&mu_);
    s = std::move(stream_);
  }
  if (s == nullptr) return;
  s->ctx.TryCancel();
  v1::SessionReply ignored;
  while (s->rw->Read(&ignored)) {
  }
  MutexLock write(&s->write_mu);
  s->rw->Finish();
  s->finished = true;
}

absl::StatusOr<std::shared_ptr<const v1::SessionReply>> QuerySession::Call(
    const v1::GetVectorsRequest& request) {
  bool stream_failed = false;
  auto reply = CallOnce(request, &stream_failed);
  if (stream_failed) reply = CallOnce(request, &stream_failed);
  return reply;
}

absl::StatusOr<std::shared_ptr<const v1::SessionReply>> QuerySession::CallOnce(
    const v1::GetVectorsRequest& request, bool* stream_failed) {
  Pending mine;
  std::shared_ptr<Stream> s;
  v1::SessionRequest message;
  {
    MutexLock lock(&mu_);
    // Not while a broken session is being finished (its requests are
    // handed their status first).
    slot_free_.Wait(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return outstanding_ < kMaxOutstanding &&
             (stream_ == nullptr || !stream_->dead);
    });
    if (stream_ == nullptr) {
      stream_ = std::make_shared<Stream>();
      stream_->rw = stub_->VectorsSession(&stream_->ctx);
    }
    s = stream_;
    const uint64_t id = next_id_++;
    s->pending.emplace(id, &mine);
    outstanding_++;
    message.set_id(id);
  }
  *message.mutable_vectors() = request;
  {
    // A failed write means the call is over; the Read that follows says
    // how, and ends every request on it (this one included).
    MutexLock write(&s->write_mu);
    if (!s->finished) s->rw->Write(message);
  }
  MutexLock lock(&mu_);
  while (!mine.done) {
    if (!s->reader_active) {
      s->reader_active = true;
      ReadUntilDone(s, &mine);
    } else {
      mine.cv.Wait(&mu_, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return mine.done || !s->reader_active;
      });
    }
  }
  *stream_failed = mine.stream_failed;
  return std::move(mine.reply);
}

void QuerySession::ReadUntilDone(const std::shared_ptr<Stream>& s,
                                 Pending* mine) {
  while (!mine->done) {
    auto reply = std::make_shared<v1::SessionReply>();
    mu_.Unlock();
    const bool ok = s->rw->Read(reply.get());
    mu_.Lock();
    if (!ok) {
      EndStream(s);  // done for every request on s, mine included
      break;
    }
    auto it = s->pending.find(reply->id());
    if (it == s->pending.end()) continue;  // not asked: ignored
    Pending* p = it->second;
    s->pending.erase(it);
    outstanding_--;
    slot_free_.Signal();
    p->done = true;
    if (reply->code() != 0) {
      p->reply = absl::Status(static_cast<absl::StatusCode>(reply->code()),
                              reply->message());
    } else {
      p->reply = std::move(reply);
    }
    if (p != mine) p->cv.Signal();
  }
  s->reader_active = false;
  // Someone else still waiting on s reads next.
  if (!s->pending.empty()) s->pending.begin()->second->cv.Signal();
}

void QuerySession::EndStream(const std::shared_ptr<Stream>& s) {
  s->dead = true;  // new callers wait until it is finished (CallOnce)
  // Every write on s has returned once the write lock is free; Finish
  // waits for the daemon's status (the reads are over).
  mu_.Unlock();
  grpc::Status status;
  {
    MutexLock write(&s->write_mu);
    status = s->rw->Finish();
    s->finished = true;
  }
  mu_.Lock();
  if (stream_ == s) stream_.reset();
  absl::Status error = FromGrpcStatus(status);
  if (error.ok()) {
    error = absl::UnavailableError(
        "shardcastd ended the query session before answering");
  }
  for (auto& [id, p] : s->pending) {
    p->done = true;
    p->stream_failed = true;
    p->reply = error;
    p->cv.Signal();
  }
  outstanding_ -= s->pending.size();
  s->pending.clear();
  slot_free_.SignalAll();
}

}  // namespace internal_client
}  // namespace shardcast
