// MessageJson against an independent JSON parser (nlohmann's): the values
// read back are the ones set in the message.
#include "client/message_json_internal.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace internal_client {
namespace {

using nlohmann::ordered_json;

TEST(MessageJson, EveryFieldByItsProtoNameWithIntegersAsNumbers) {
  v1::ServerStatus s;
  s.set_version("0.1.0 \"q\" \\ \n\t\x01 é");
  s.set_uptime_seconds(1.5);
  s.set_calls_total(std::numeric_limits<uint64_t>::max());
  s.set_node_rank(-3);
  v1::ScanStatus* scan = s.add_scans();
  scan->set_dataset("abc");
  scan->set_blocks(7);
  scan->add_clients()->set_epoch(2);
  v1::Figure* f = s.add_figures();
  f->set_name("shardcast_x");
  f->add_label_names("a");
  v1::FigureSample* sample = f->add_samples();
  sample->add_labels("v");
  sample->set_value(std::nan(""));

  const ordered_json j = ordered_json::parse(MessageJson(s));
  // Declaration order, unset fields present with their zero values.
  const google::protobuf::Descriptor* d = v1::ServerStatus::descriptor();
  ASSERT_EQ(j.size(), static_cast<size_t>(d->field_count()));
  int k = 0;
  for (auto it = j.begin(); it != j.end(); ++it, ++k) {
    EXPECT_EQ(it.key(), d->field(k)->name());
  }
  EXPECT_EQ(j["version"], "0.1.0 \"q\" \\ \n\t\x01 é");
  EXPECT_EQ(j["uptime_seconds"], 1.5);
  ASSERT_TRUE(j["calls_total"].is_number_unsigned());
  EXPECT_EQ(j["calls_total"].get<uint64_t>(),
            std::numeric_limits<uint64_t>::max());
  ASSERT_TRUE(j["node_rank"].is_number_integer());
  EXPECT_EQ(j["node_rank"].get<int64_t>(), -3);
  EXPECT_EQ(j["bytes_served"], 0);
  EXPECT_EQ(j["local_accept_starved"], false);
  EXPECT_EQ(j["streams"], ordered_json::array());
  ASSERT_EQ(j["scans"].size(), 1u);
  EXPECT_EQ(j["scans"][0]["dataset"], "abc");
  EXPECT_EQ(j["scans"][0]["blocks"], 7);
  EXPECT_EQ(j["scans"][0]["clients"][0]["epoch"], 2);
  EXPECT_EQ(j["figures"][0]["label_names"], ordered_json::array({"a"}));
  EXPECT_EQ(j["figures"][0]["samples"][0]["labels"],
            ordered_json::array({"v"}));
  EXPECT_TRUE(j["figures"][0]["samples"][0]["value"].is_null());
}

TEST(MessageJson, BytesAreBase64) {
  v1::Vectors r;
  r.set_data(std::string("\x00\x01\xff", 3));
  const ordered_json j = ordered_json::parse(MessageJson(r));
  EXPECT_EQ(j["data"], "AAH/");  // base64 of 00 01 ff, by hand
}

}  // namespace
}  // namespace internal_client
}  // namespace shardcast
