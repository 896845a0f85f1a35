package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

type dtoMetric struct{ count uint64 }

func (m *dtoMetric) read(t *testing.T, o prometheus.Observer) {
	t.Helper()
	var pb dto.Metric
	if err := o.(prometheus.Metric).Write(&pb); err != nil {
		t.Fatal(err)
	}
	m.count = pb.GetHistogram().GetSampleCount()
}
