(define (problem plan_trial_T20261122_300001_000001)
    (:domain alfred)
    (:objects
        agent1 - agent
        EggType - otype
        SinkBasinType - rtype
        MicrowaveType - rtype
        CounterTopType - rtype
        Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30 - object
        Sink_bar__minus_01_dot_70_bar__plus_00_dot_90_bar__minus_01_dot_31_bar_SinkBasin - receptacle
        Microwave_bar__plus_01_dot_83_bar__plus_00_dot_90_bar__minus_01_dot_38 - receptacle
        CounterTop_bar__plus_00_dot_69_bar__plus_00_dot_95_bar__minus_01_dot_50 - receptacle
        loc_bar__minus_6_bar__minus_3_bar_2_bar_60 - location
        loc_bar_6_bar__minus_3_bar_2_bar_30 - location
        loc_bar_3_bar__minus_3_bar_2_bar_45 - location
        loc_bar_0_bar_2_bar_2_bar_30 - location
        )
    (:init
        (receptacleType Sink_bar__minus_01_dot_70_bar__plus_00_dot_90_bar__minus_01_dot_31_bar_SinkBasin SinkBasinType)
        (receptacleType Microwave_bar__plus_01_dot_83_bar__plus_00_dot_90_bar__minus_01_dot_38 MicrowaveType)
        (receptacleType CounterTop_bar__plus_00_dot_69_bar__plus_00_dot_95_bar__minus_01_dot_50 CounterTopType)
        (objectType Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30 EggType)
        (canContain SinkBasinType EggType)
        (canContain MicrowaveType EggType)
        (canContain CounterTopType EggType)
        (openable Microwave_bar__plus_01_dot_83_bar__plus_00_dot_90_bar__minus_01_dot_38)
        (pickupable Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30)
        (cleanable Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30)
        (heatable Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30)
        (coolable Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30)
        (sliceable Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30)
        (atLocation agent1 loc_bar_0_bar_2_bar_2_bar_30)
        (receptacleAtLocation Sink_bar__minus_01_dot_70_bar__plus_00_dot_90_bar__minus_01_dot_31_bar_SinkBasin loc_bar__minus_6_bar__minus_3_bar_2_bar_60)
        (receptacleAtLocation Microwave_bar__plus_01_dot_83_bar__plus_00_dot_90_bar__minus_01_dot_38 loc_bar_6_bar__minus_3_bar_2_bar_30)
        (receptacleAtLocation CounterTop_bar__plus_00_dot_69_bar__plus_00_dot_95_bar__minus_01_dot_50 loc_bar_3_bar__minus_3_bar_2_bar_45)
        (inReceptacle Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30 Sink_bar__minus_01_dot_70_bar__plus_00_dot_90_bar__minus_01_dot_31_bar_SinkBasin)
        (objectAtLocation Egg_bar__minus_01_dot_74_bar__plus_00_dot_82_bar__minus_01_dot_30 loc_bar__minus_6_bar__minus_3_bar_2_bar_60)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (heatable ?o)
                        (objectType ?o EggType)
                        (receptacleType ?r CounterTopType)
                        (isHot ?o)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
