#include "ffi/plan_record.h"

#include <mutex>

namespace fastattn {

namespace {

std::mutex mu;
std::map<std::string, PlanFacts>& Records() {
  static auto* records = new std::map<std::string, PlanFacts>();
  return *records;
}

}  // namespace

void RecordPlan(const std::string& target, PlanFacts facts) {
  std::lock_guard<std::mutex> lock(mu);
  Records()[target] = std::move(facts);
}

std::map<std::string, PlanFacts> RecordedPlans() {
  std::lock_guard<std::mutex> lock(mu);
  return Records();
}

}  // namespace fastattn
